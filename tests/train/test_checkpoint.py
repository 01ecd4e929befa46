"""Checkpoints in one process (flashcp.train.checkpoint): refusals, and the sharded (DCP) format."""

import pytest
import torch

from flashcp.errors import FlashcpError
from flashcp.runtime import CPLoader
from flashcp.train import load_checkpoint, save_checkpoint


def test_checkpoint_refusals(planned, tmp_path):
    root, _ = planned
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    loader = CPLoader(root, "cp1-llama3-like", 0, 1)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, step=4, model=model, optimizer=optimizer, loader=loader, config={"dim": 2})
    assert load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 2}) == 4
    assert not list(tmp_path.glob(".ckpt.pt.*"))  # no temporary file left behind
    with pytest.raises(FlashcpError, match=r"different run: dim 2 \(now 3\)"):
        load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 3})
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(FlashcpError, match="cannot be read"):
        load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 2})
    torch.save({"format": 99}, path)
    with pytest.raises(FlashcpError, match="has format 99"):
        load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 2})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_in_one_process(planned, tmp_path):
    import os

    from flashcp.train.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

    root, _ = planned
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    loader = CPLoader(root, "cp1-llama3-like", 0, 1)
    next(iter(loader))
    folder = tmp_path / "ckpts"
    folder.mkdir()
    path = folder / "ck"
    save_sharded_checkpoint(path, step=2, model=model, optimizer=optimizer, loader=loader, config={"dim": 3})
    save_sharded_checkpoint(path, step=3, model=model, optimizer=optimizer, loader=loader, config={"dim": 3})
    assert sorted(p.name for p in folder.iterdir()) == ["ck"], "no staging or old folder left behind"
    os.replace(path, folder / ".ck.old")  # as if a save was killed between its two renames
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh_loader = CPLoader(root, "cp1-llama3-like", 0, 1)
    assert load_sharded_checkpoint(path, model=fresh, optimizer=fresh_opt, loader=fresh_loader,
                                   config={"dim": 3}) == 3
    assert torch.equal(fresh.weight, model.weight) and fresh_loader.state_dict() == loader.state_dict()
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    user_folder = folder / "mine"
    user_folder.mkdir()
    (user_folder / "notes.txt").write_text("keep")
    with pytest.raises(FlashcpError, match="exists and is not a flashcp sharded checkpoint"):
        save_sharded_checkpoint(user_folder, step=1, model=model, optimizer=optimizer, loader=loader, config={})
    assert [p.name for p in user_folder.iterdir()] == ["notes.txt"]
