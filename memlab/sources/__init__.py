"""Memory sources: where memlab's numbers come from (a real GPU, or a tracker plus an allocator model)."""
