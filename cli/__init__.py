"""fqr's command line (installed under the import name ``fqr_cli``; console script ``fqr``)."""
