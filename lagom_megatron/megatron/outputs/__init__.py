"""A run's files (plan, profile, tuner tables) and its report."""
