"""The models the daemon serves: loading, versions, reload, and watching their files."""
