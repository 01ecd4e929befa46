"""A transformers model trained with flashcp CP inside the Hugging Face Trainer, checked against one process.

    flashcp synth DATA --dist wlb --num-seqs 16 --context-len 2048 --vocab-size 1024
    flashcp plan DATA --cp 2
    torchrun --nproc-per-node 2 examples/hf_trainer.py DATA cp2-flashcp2 OUT [--resume] [--arch ARCH]

ARCH is ``llama`` (default) or ``qwen2``, or a hybrid whose recurrent layers flashcp runs across the ranks:
``qwen3_next`` or ``qwen3_5`` (a Gated DeltaNet layer, then gated full attention), ``nemotron_h`` (a Mamba-2
block, then an attention block). The model is tiny (hidden size 128, 2 layers, vocabulary 1024), random, the same
on every rank. After training, rank 0 trains the same steps again in this one process with every document of
each packed sequence run alone through the unmodified transformers model (a hybrid's recurrent state starts at
zero at each document), and prints the largest difference of the logged losses: float32 rounding on CPU (about
1e-6), bf16 rounding on a GPU. The check needs one replica (as many ranks as the plan's cp) and a fresh run.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import TrainingArguments

from flashcp.integrations.hf import HF_ARCHITECTURES, tiny_hf_model
from flashcp.integrations.hf_trainer import CPTrainer
from flashcp.runtime import CPLoader
from flashcp.train.launch import ending_together

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("data")
parser.add_argument("plan")
parser.add_argument("output_dir")
parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in OUT")
parser.add_argument("--arch", default="llama", choices=HF_ARCHITECTURES)
cli = parser.parse_args()
SHAPE = dict(vocab_size=1024, dim=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=256)


def make_model(attn_implementation: str = "cp_attention") -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank, and for the one-process check
    return tiny_hf_model(cli.arch, **SHAPE, attn_implementation=attn_implementation)


def one_process_losses(args: TrainingArguments, steps: int) -> list[float]:
    """The Trainer's steps in one process: the same sequences, optimizer and clipping, documents apart."""
    model = make_model("eager").to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    stream = iter(CPLoader(cli.data, None, 0, 1, seed=args.seed, shuffle=True))  # the CP run's order, all tokens
    losses = []
    for _ in range(steps):
        batches = [next(stream) for _ in range(args.gradient_accumulation_steps)]
        total = torch.zeros((), device=args.device)
        for batch in batches:
            starts = [*torch.nonzero(batch.position_ids == 0).flatten().tolist(), batch.input_ids.numel()]
            for start, end in zip(starts, starts[1:]):  # each document alone: nothing carries over
                doc = batch.input_ids[start:end].to(args.device)
                logits = model(input_ids=doc[None], use_cache=False).logits[0]
                total = total + F.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum")
        loss = total / sum(batch.num_label_tokens for batch in batches)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


gpu = torch.cuda.is_available()
args = TrainingArguments(output_dir=cli.output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                         max_steps=4, learning_rate=1e-3, lr_scheduler_type="constant", optim="adamw_torch",
                         logging_steps=1, save_steps=2, bf16=gpu, use_cpu=not gpu, ddp_find_unused_parameters=False,
                         report_to="none", disable_tqdm=True)
with ending_together():  # the process group the Trainer starts under torchrun ends here, not at interpreter exit
    trainer = CPTrainer(model=make_model(), args=args, train_dataset=cli.data, plan=cli.plan)  # dp x cp = ranks
    trainer.train(resume_from_checkpoint=cli.resume or None)
    if (not dist.is_initialized() or dist.get_rank() == 0) and trainer.dp_size == 1 and not cli.resume:
        logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        reference = one_process_losses(args, len(logged))
        worst = max(abs(a - b) for a, b in zip(logged, reference))
        print(f"{cli.arch}: largest |loss difference| against one process with documents apart: {worst:.2e} "
              f"over {len(logged)} steps")
