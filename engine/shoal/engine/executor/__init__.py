"""Executors: fan one control call out to every worker rank (`collective_rpc`)."""
