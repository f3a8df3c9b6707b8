"""A Hugging Face Trainer job on two ranks (torchrun, gloo, CPU): a tiny GPT-2 from its config
trained on random tokens, gradient accumulation 2, the Trainer's default clipping (1.0), with
``Trainer(..., callbacks=[GradwatchCallback()])``. See tests/jobs/common.py."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradwatch.integrations.hf import GradwatchCallback

from common import OUT, STEPS, Reference, injected


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (16,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


class JobTrainer(Trainer):
    """The user's Trainer: the blow-up is injected in its loss; its training steps' returns
    (what the Trainer sums into the loss it logs) are recorded."""

    ref: Reference = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * injected(self.state.global_step + 1)

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, inputs, num_items_in_batch)
        self.ref.loss(self.state.global_step + 1, out)
        return out


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=OUT, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    trainer = JobTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[GradwatchCallback()])
    trainer.create_optimizer()
    trainer.ref = Reference(trainer.optimizer, model.named_parameters, lambda: trainer.state.global_step + 1,
                            reduce="sum")  # the Trainer logs the sum of training_step's returns
    trainer.train()
    trainer.ref.write(log=[e for e in trainer.state.log_history if "loss" in e])


if __name__ == "__main__":
    main()
