"""Model-based rewards (``reward.reward_model.*``): a discriminative reward model scoring (prompt, response)."""
