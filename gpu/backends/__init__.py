"""Ways a step's math runs besides the torch path (fused trunk, graphs); new backends go here."""
