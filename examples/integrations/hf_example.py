"""The smallest transformers.Trainer run checkpointed by pcframe: run it, kill it, run it again.

python hf_example.py      # checkpoints in ./ckpts-hf; a second run resumes from there
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from pcframe.integrations.transformers import PcframeCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# A tiny Llama from a config: nothing is downloaded.
config = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
args = TrainingArguments(
    output_dir="hf-out",
    max_steps=40,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    save_strategy="no",  # pcframe saves instead of the Trainer
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
)
callback = PcframeCallback("ckpts-hf", save_steps=10)  # or policy="young"
trainer = Trainer(
    LlamaForCausalLM(config), args, train_dataset=RandomTokens(), callbacks=[callback]
)
trainer.train()  # resumes from the newest valid pcframe version
if callback.resumed_step is not None:
    print(f"resumed from step {callback.resumed_step}")
print(f"trained to step {trainer.state.global_step}")
