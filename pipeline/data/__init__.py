"""Data formats the stages exchange: conversations, JSON Lines shards, the capture contract,
capture shards, and prompt de-duplication."""
