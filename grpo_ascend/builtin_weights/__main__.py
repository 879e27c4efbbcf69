"""``python -m grpo_ascend.builtin_weights``: rebuild the shipped warm starts from scratch."""

from grpo_ascend.builtin_weights import main

raise SystemExit(main())
