"""Test beds that run real servers on loopback: scripted upstreams and a simulated language model."""
