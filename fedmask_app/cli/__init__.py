"""Console scripts: fedmask-local, fedmask-sweep, fedmask-report, fedmask-export-shards."""
