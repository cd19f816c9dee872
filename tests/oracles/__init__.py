"""Test-only reference implementations and tiny random checkpoints."""
