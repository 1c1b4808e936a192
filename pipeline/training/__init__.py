"""Training: the worker each rank runs, the nodes that start them, and the data streamed from
capture shards."""
