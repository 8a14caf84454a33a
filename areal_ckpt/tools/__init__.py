"""Command-line tools: areal-ckpt's commands, converters, inspection (describe / verify / list), the AReaL importer and the relaunching launcher."""
