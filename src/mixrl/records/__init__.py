"""The records that cross boundaries, each with its one check."""
