"""Ray launch: the only package (with its workers) that imports ray."""
