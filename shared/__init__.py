"""Code both services share. Torch-free: the scheduler imports it."""
