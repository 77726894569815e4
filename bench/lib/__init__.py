"""The parts bench/'s entry points share: timing and device ceilings, the kernel cases and peers,
the serving workload and engine, rooflines, the online driver, the transformers peers, the lean
HTTP client. Entry points put the checkout on sys.path and import these as `bench.lib.<module>`."""
