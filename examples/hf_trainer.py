"""A stock transformers Llama trained with flashcp CP inside the Hugging Face Trainer (every rank runs this).

    flashcp synth DATA --dist wlb --num-seqs 16 --context-len 2048 --vocab-size 1024
    flashcp plan DATA --cp 2
    torchrun --nproc-per-node 2 examples/hf_trainer.py DATA cp2-flashcp2 OUT [--resume]
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from flashcp.integrations.hf_trainer import CPTrainer
from flashcp.train.launch import ending_together

data, plan, output_dir = sys.argv[1:4]
torch.manual_seed(0)  # the same initial weights on every rank
model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
gpu = torch.cuda.is_available()
args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                         max_steps=4, learning_rate=1e-3, logging_steps=1, save_steps=2, bf16=gpu, use_cpu=not gpu,
                         ddp_find_unused_parameters=False, report_to="none", disable_tqdm=True)
with ending_together():  # the process group the Trainer starts under torchrun ends here, not at interpreter exit
    trainer = CPTrainer(model=model, args=args, train_dataset=data, plan=plan)  # dp x cp = the ranks launched
    trainer.train(resume_from_checkpoint="--resume" in sys.argv[4:] or None)
