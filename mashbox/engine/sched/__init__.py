"""Which tokens run next: sequences, the scheduler and its pace, KV slots, the prefix cache in memory and on disk."""
