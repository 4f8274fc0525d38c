"""``python -m verl.experimental.fully_async_policy.fully_async_main [overrides]``: fully asynchronous training.

Without a model path it runs the embedded demo on two resource pools (``fully_async_demo``); otherwise it
composes ``fully_async_ppo_trainer`` (upstream's config name) from this folder's ``config/``.
"""

import sys

from verl.experimental.async_policy.launch import main as _main


def main(argv=None) -> int:
    return _main("fully_async", argv)


if __name__ == "__main__":
    sys.exit(main())
