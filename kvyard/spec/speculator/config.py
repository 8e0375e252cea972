"""What `kvyard speculator train` does, and its defaults: one place for the CLI and the training code.

Kept apart from train.py so that building the CLI parser imports nothing heavy.
"""

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    target: str
    prompts: str
    out: str
    init_layers: list[int] = field(default_factory=lambda: [0, 1])  # negative: from the end
    draft_vocab: int = 8192  # 0: the whole vocabulary
    loss: str = "hard"  # hard (the target's argmax) or soft (its top-20 distribution)
    max_tokens: int = 160  # per generated sample
    num_prompts: int | None = None
    temperature: float = 0.0  # of the data generation
    epochs: int = 6
    lr: float = 1e-3
    batch_tokens: int = 1024
    holdout: float = 0.05
    seed: int = 0
    dtype: str = "bfloat16"  # of the engine that generates the data (the serving dtype)
    kv_cache_memory: str = "1GiB"
    prompt_lookup: bool = True  # the speculator tries prompt lookup before its model
    data_cache: str | None = None  # distilled samples: read if the file exists, else written after generating
    progress: bool = True
