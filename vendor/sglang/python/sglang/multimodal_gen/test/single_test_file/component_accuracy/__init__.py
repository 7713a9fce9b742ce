"""Component accuracy test helpers and suites."""
