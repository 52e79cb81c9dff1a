"""Device, precision and memory-budget helpers shared by engines and algorithms, and the one thread their PyTorch work runs on."""
