"""The node side: what runs once per node inside an allocation (the entry point, the launcher, the
direct launch of ranks, the rendezvous store, the ranks' site hooks)."""
