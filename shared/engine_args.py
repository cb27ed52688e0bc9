"""The flags of the engine configs, taken by the scheduler and worker services.

The scheduler and every worker of one engine must agree on these (block size,
batch limits), so both parse the same flags into the config dataclasses of
``shared/config.py``.
"""

from __future__ import annotations

import argparse

from shared.cli import add_config_flags
from shared.config import (
    CacheConfig,
    EngineServiceConfig,
    KVOffloadConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelRunConfig,
    ParallelConfig,
    SchedulerConfig,
)

ENGINE_CONFIGS = (EngineServiceConfig, ModelRunConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig,
                  KVTransferConfig, KVOffloadConfig)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for config_cls in ENGINE_CONFIGS:
        add_config_flags(parser, config_cls)
