"""Work-arounds for the third-party stack; each module says which trap it removes."""
