from flashcp.cli import main

main()
