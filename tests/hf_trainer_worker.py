"""Run CPTrainer cases on torchrun ranks for tests/integrations/test_hf_trainer.py (one launch per world size).

``python -m torch.distributed.run --nproc-per-node N tests/hf_trainer_worker.py SPEC.json``: SPEC holds the
dataset folder, an output folder and a list of cases; for each case every rank builds the same seeded tiny model
(``"dtype"``: float32 unless the case names another) and trains it with CPTrainer (or CPSFTTrainer), and rank 0
saves ``{name}.pt`` with the Trainer's log history and the final parameters (gathered when FSDP shards them). A
case may skip training (``"train": false``) and evaluate after it (``"evaluate": true``). A case whose
construction or training raises ValueError records the message instead (``{"error": ...}``), on every rank alike.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

SHAPE = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)
SEED = 7
LR = 1e-2


def make_model(arch: str, attn_implementation: str = "cp_attention", dtype: str = "float32"):
    from flashcp.integrations.hf import tiny_hf_model

    torch.manual_seed(SEED)
    return tiny_hf_model(arch, **SHAPE, attn_implementation=attn_implementation, dtype=getattr(torch, dtype))


def training_arguments(output_dir: str, **overrides):
    from transformers import TrainingArguments

    values = dict(output_dir=output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=3,
                  learning_rate=LR, logging_steps=1, save_strategy="no", use_cpu=True, ddp_backend="gloo",
                  report_to="none", disable_tqdm=True, seed=SEED, dataloader_pin_memory=False)
    values.update(overrides)
    return TrainingArguments(**values)


def tiny_tokenizer():
    """A word-level tokenizer over the 64 ids of the tiny models (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"] - 2)} | {"<pad>": 62, "<eos>": 63}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


def run_case(case: dict, data: str, out: Path) -> dict:
    """Train one case on this rank; returns what rank 0 saves. A ``script`` case runs that file as __main__."""
    if "script" in case:
        saved_argv = sys.argv
        sys.argv = [case["script"], *case["argv"]]
        try:
            runpy.run_path(case["script"], run_name="__main__")
        finally:
            sys.argv = saved_argv
        return {}
    from flashcp.integrations import hf_trainer
    from flashcp.train.parallel import full_parameters

    args = training_arguments(str(out / case["name"]), **case.get("args", {}))
    model = make_model(case["arch"], dtype=case.get("dtype", "float32"))
    kwargs: dict = dict(model=model, args=args, train_dataset=data, plan=case["plan"], **case.get("trainer_kwargs", {}))
    if case.get("trainer") == "sft":
        kwargs["processing_class"] = tiny_tokenizer()
        trainer = hf_trainer.CPSFTTrainer(**kwargs)
    else:
        trainer = hf_trainer.CPTrainer(**kwargs)
    if case.get("train", True):
        trainer.train(resume_from_checkpoint=case.get("resume"))
    if case.get("evaluate"):
        trainer.evaluate()
    params = full_parameters(trainer.model)
    return {"log_history": trainer.state.log_history, "params": params,
            "wrapped": type(trainer.model_wrapped).__name__}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    training_arguments(str(out / "init"))  # initialises the process group (accelerate)
    rank = dist.get_rank()
    for case in spec["cases"]:
        try:
            result = run_case(case, spec["data"], out)
        except ValueError as e:
            result = {"error": str(e)}
        if rank == 0:
            torch.save(result, out / f"{case['name']}.pt")
        if not dist.is_initialized():  # an example script ends the group it ran under (it runs last)
            return
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
