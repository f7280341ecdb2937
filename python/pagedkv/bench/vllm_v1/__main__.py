"""``python -m pagedkv.bench.vllm_v1``: the v1 whole-step section for the installed vLLM."""

import sys

from pagedkv.bench.vllm_v1.section import main

sys.exit(main())
