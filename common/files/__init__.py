"""Files read from and written for a user, with their checks (no model knowledge)."""
