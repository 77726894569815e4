"""Models that attend through `cache.update_and_attend`: SenseNova-U1 and a transformers adapter."""
