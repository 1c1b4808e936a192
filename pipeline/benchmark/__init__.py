"""The benchmark: engines behind one interface."""
