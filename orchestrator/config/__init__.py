"""What a run is, before it runs: strategies, options, cluster profiles, the checked plan, and its
rendering into text. Pure functions over typed records; no scheduler, registry or process."""
