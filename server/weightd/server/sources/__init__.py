"""Remote sources: models and adapters in S3-compatible object storage, downloaded once
per host into a verified local cache and then served exactly as a local directory."""
