"""The tool-call formats, one module per kind of format; ``lifecycle.chat.tool_formats``
names them and picks one."""
