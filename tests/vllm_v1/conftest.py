"""Tests that run inside a vLLM virtualenv (see tests/test_vllm_v1.py, which starts them).

vLLM 0.33's wheel is its CUDA build; on a machine without a GPU it finds no platform unless
told to use the CPU one. The scheduler and the KV cache manager never touch a device.
"""

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
