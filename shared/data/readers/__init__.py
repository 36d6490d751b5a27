"""One streaming reader per dataset format (``shared.data.read.read_batches`` picks one)."""
