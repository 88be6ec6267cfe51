"""The model a run trains: loading, building, sharding, attention over packed rows, compile and activation checkpointing."""
