"""``python -m pagedkv.bench [options]``: the same as ``pagedkv bench [options]``."""

import sys

from pagedkv.bench import main

sys.exit(main())
