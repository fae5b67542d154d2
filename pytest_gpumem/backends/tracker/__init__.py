"""The tracker: exact bytes of the tensor storages that ATen ops create, for machines without a GPU."""
