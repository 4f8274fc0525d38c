"""``python -m verl.experimental.one_step_off_policy.main_ppo [overrides]``: one-step off-policy training.

Without a model path it runs the embedded demo on two resource pools (``one_step_off_demo``); otherwise it
composes ``one_step_off_ppo_trainer`` (upstream's config name) from this folder's ``config/``.
"""

import sys

from verl.experimental.async_policy.launch import main as _main


def main(argv=None) -> int:
    return _main("one_step_off", argv)


if __name__ == "__main__":
    sys.exit(main())
