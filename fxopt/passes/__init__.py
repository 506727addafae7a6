"""Graph rewrites, one per file, each a function of (graph module(s), plan)."""
