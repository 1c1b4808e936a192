"""Development-only tools: what runs the production path on this machine (the rehearsal's local
cluster and container runtime). Nothing in the pipeline's library imports them."""
