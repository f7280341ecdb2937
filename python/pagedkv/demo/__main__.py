"""``python -m pagedkv.demo [options]``: the same as ``pagedkv demo [options]``."""

import sys

from pagedkv.demo import main

sys.exit(main())
