"""The P/D decode-instance workload of the v1 bench (``decode``): W1's requests (the same
prompts, output lengths, ``n=2`` forks and predetermined tokens) on an engine with vLLM's own
``DecodeBenchConnector``, which hands every new request's uncomputed prompt but its last token
to the KV cache manager as external (connector) tokens, loaded synchronously: what a decode
instance of a prefill/decode split schedules once the prefill instance has sent the KV.

pagedkv's ``Scheduler`` runs its native loop with the connector (the loop lane); the manager
lane runs vLLM's loop over the native manager: this workload measures both with external
tokens in every admission.

Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.workload import W1_FULL, W1_QUICK, Workload, WorkloadConfig
from pagedkv.bench.workload import generate as generate_plain


@dataclass(frozen=True)
class ConnectorConfig:
    """W1's config ``base`` on an engine with the KV connector class named ``connector``."""

    base: WorkloadConfig = W1_FULL
    connector: str = "DecodeBenchConnector"

    @property
    def watermark(self) -> float:
        return self.base.watermark


DECODE_FULL = ConnectorConfig(W1_FULL)
DECODE_QUICK = ConnectorConfig(W1_QUICK)


def generate(cfg: ConnectorConfig, seed: int = 0) -> Workload:
    """W1's requests named ``decode-<i>``..., the connector's name attached."""
    work = generate_plain(dataclasses.replace(cfg.base, name="DECODE"), seed=seed)
    work.connector = cfg.connector  # type: ignore[attr-defined]
    return work


def connector_of(workload: Any) -> str:
    """The KV connector a workload's engines run (``""``: none)."""
    return getattr(workload, "connector", "")


def transfer_config(connector: str) -> Any:
    """vLLM's ``KVTransferConfig`` naming ``connector`` (a registered connector class), both
    roles, as a decode instance configures it."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=connector, kv_role="kv_both")
