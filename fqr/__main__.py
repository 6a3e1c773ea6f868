from fqr_cli.app import main

main()
