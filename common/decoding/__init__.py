"""Greedy and beam search, written once over any framework's stepper."""
