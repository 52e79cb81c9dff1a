"""Test-only helpers shared across test packages: real servers on loopback that tests drive."""
