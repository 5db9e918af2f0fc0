"""What the test suite, the benches and the docs' recipes share: small models and corpora
built locally (no download), Debian's Chromium as the tests launch it, the S3-compatible test
server and process-group helpers. Product code never imports this package."""
