"""Decoding: the reference speculative decoder, and the speedup model that predicts tokens/s from
acceptance."""
