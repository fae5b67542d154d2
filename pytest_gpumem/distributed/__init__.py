"""A measured torch.distributed world: spawning ranks, each rank's worker, the messages between them."""
