"""The trace contract: schema and manifest (schema.py), TraceWriter (writer.py) and its status (status.py),
readers (reader.py), the Arrow IPC stream (stream.py)."""

from r3trace.trace.commit import write_heat_run
from r3trace.trace.reader import RunFiles, TokenRoutes, open_dataset, read_token_routes, recover_run
from r3trace.trace.schema import PHASES, SOURCES, FileEntry, Manifest, TraceSchemaError, route_schema
from r3trace.trace.status import WriterStatus
from r3trace.trace.stream import TraceStreamWriter, read_stream
from r3trace.trace.writer import TraceWriter

__all__ = [
    "PHASES", "SOURCES", "FileEntry", "Manifest", "RunFiles", "TokenRoutes", "TraceSchemaError",
    "TraceStreamWriter", "TraceWriter", "WriterStatus", "open_dataset", "read_stream", "read_token_routes",
    "recover_run", "route_schema", "write_heat_run",
]
